"""Compiled kernels.  Import them through fastconv._dispatch, which picks the
ISA build this CPU can run."""
