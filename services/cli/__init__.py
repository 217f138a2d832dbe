"""The `stagemesh` commands: the dispatcher (main) and the commands that are not a process of their own (up, local, plan, status, trace)."""
