"""Job configs: Python files returning an ml_collections.ConfigDict (`get_config(arg)`)."""
