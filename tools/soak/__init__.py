"""Sections of ``tools/fault_soak.py`` (issue 10): each module runs one fault scenario and
returns a dict of figures. Scripts' helpers, not tests: pytest does not collect ``tools/``."""
