from storage_backends.log_throttle import LogThrottle  # noqa: F401  # moved there; this alias goes next
