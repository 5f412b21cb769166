"""For tests/ and fuzz/ alike: hypothesis without its per-example deadline. The deadline is
a timing assertion, and on a shared, loaded machine (CI, or a build running beside the
tests) it fails examples that are only slow; speed is measured in bench/, never asserted."""

from hypothesis import settings

settings.register_profile("narwhal", deadline=None)
settings.load_profile("narwhal")
