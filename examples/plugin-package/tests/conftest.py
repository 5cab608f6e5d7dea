pytest_plugins = ["relay.testing.fixtures"]
