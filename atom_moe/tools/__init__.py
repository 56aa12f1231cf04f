"""The `atom-moe` command-line tools, one module each (cli.py dispatches); shared timing,
floor and CSV helpers in common.py. Nothing in the core imports from here."""
