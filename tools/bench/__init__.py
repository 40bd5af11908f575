"""The benchmarks behind ``tools/bench_tiers.py`` (every tier of TieredStore against this machine's
limits) and ``tools/bench_e2e.py`` (TTFT and decode overhead on the reference engine). Those two
scripts are thin launchers of ``tiers_main`` and ``e2e_main``; the tiered_kv internals the
benchmarks reach into are gathered in ``internals``. Scripts' helpers, not tests: pytest does not
collect ``tools/``."""
