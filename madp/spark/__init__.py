"""madp on Apache Spark (`--runner pyspark`): the bounding (`madp.spark.bound`) and the batching
(`madp.spark.batch`) on PySpark RDDs, natively. Spark moves the partitions and calls the steps of
`madp.core` (`bound_steps`, `batch_steps`, `input_splits`, `record_reading`); nothing here imports
Apache Beam. `session` holds the options and the SparkSession, `records` reads the input in splits and
groups it into record partitions."""
