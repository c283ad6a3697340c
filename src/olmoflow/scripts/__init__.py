"""Module entry points in the form OLMo's documentation uses (``python -m olmoflow.scripts.X``)."""
