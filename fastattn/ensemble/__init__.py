"""`python -m fastattn.ensemble`: __main__.py runs the command line of
fastattn/inference/ensemble_command.py (the library, fastattn.Ensemble, is
fastattn/inference/ensemble.py)."""
