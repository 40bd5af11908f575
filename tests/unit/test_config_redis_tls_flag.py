"""A Redis URL whose TLS options redis-py itself refuses is a bad config like any other."""

import pytest

from tiered_kv.config import TieredKVConfig
from tiered_kv.errors import ConfigError


def test_regression_a_rediss_url_with_a_bad_ssl_cert_reqs_raised_a_redis_error_out_of_the_config():
    url = "rediss://:sekrit@127.0.0.1:6390/0?ssl_cert_reqs=bogus"
    with pytest.raises(ConfigError) as caught:
        TieredKVConfig.from_dict({"remote": {"url": url}})
    assert "ssl_cert_reqs" in str(caught.value) or "SSL" in str(caught.value)
    assert "sekrit" not in str(caught.value)
