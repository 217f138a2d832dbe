"""Load testing: `stagemesh bench`."""
