"""Tools around the pipeline, by purpose: data to run it on (`data`: synthetic data, mbox import),
planning a job (`planning`: the k sweep, the audit section of a config), and the HTML report of a
run (`report`)."""
