"""Tools around the pipeline: synthetic data, mbox import, the HTML report, the k sweep, and the
audit section of a config."""
