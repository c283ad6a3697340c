"""olmoflow: the OLMo model flow, open end to end."""
__version__ = "0.1.0"
