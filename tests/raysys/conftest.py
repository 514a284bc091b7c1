from tests.raysys.ray_fixtures import ray_cluster  # noqa: F401  (the session's one Ray)
