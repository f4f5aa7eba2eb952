"""Settings for the whole suite."""

from hypothesis import settings

# Property tests assert behaviour, never speed: hypothesis' per-example deadline (200 ms) is a
# timing assertion that fails on a loaded shared machine, so it is off everywhere.
settings.register_profile("stoker", deadline=None)
settings.load_profile("stoker")
