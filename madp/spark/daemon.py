"""PySpark's daemon for madp's tasks (`spark.python.daemon.module`, which the sessions madp builds set
where the user did not): the modules that madp's tasks run are imported once, in the daemon, so that
every Python worker it forks starts with them instead of importing them for its first task. Then
PySpark's own daemon (`pyspark.daemon.manager`) runs as usual.

PySpark's daemon imports a worker's modules after the fork because a library may start threads when
imported, and a forked child has only the thread that forked it. These imports (no pandas among them)
start two: OpenBLAS's thread pool (numpy) and jemalloc's background thread (pyarrow), and both
libraries register fork handlers (`pthread_atfork`) that leave a child's BLAS and allocator working
(`tests/spark/test_spark_options.py` forks workers that use both)."""

import pyspark.daemon
import pyspark.worker  # noqa: F401  # what every worker runs; pyspark's daemon imports it after the fork

import madp.spark.batch  # noqa: F401
import madp.spark.bound  # noqa: F401

if __name__ == "__main__":
    pyspark.daemon.manager()
