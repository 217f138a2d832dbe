"""stagemesh's processes: the CLI, the stage worker, the gateway."""
