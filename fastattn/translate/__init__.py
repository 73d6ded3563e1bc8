"""`python -m fastattn.translate`: __main__.py runs the command line of
fastattn/inference/translate_command.py (the library, fastattn.Translator, is
fastattn/inference/translator.py)."""
