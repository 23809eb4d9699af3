"""Planning a job before it runs: the contribution bound k swept on the input's graph and what each k
needs of the sampler and the accountant (`recommend`), and the audit section of a config
(`audit_config`)."""
