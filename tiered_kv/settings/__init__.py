"""What :mod:`tiered_kv.config` is made of: building frozen configs from a dict, a TOML file or
``TIERED_KV_*`` variables (:mod:`.loading`), and the lower tiers' settings (:mod:`.tiers`)."""
