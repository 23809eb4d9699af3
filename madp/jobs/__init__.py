"""Jobs made of commands: `madp run` (plan and run a config's stages) and `madp audit`."""
