"""Opt-in tests that drive SGLang 0.5.23's own HiCache code on CPU (tools/check_sglang.sh)."""
