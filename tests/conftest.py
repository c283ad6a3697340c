"""Shared by every test directory. Being here puts ``tests/`` on ``sys.path`` (pytest's default
import mode), so a test anywhere below can ``from tolerance import ...``."""
