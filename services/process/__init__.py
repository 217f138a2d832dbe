"""What every process's start shares: generated flags (args), mesh keys and their flags (keys), starting stage processes on loopback (launch)."""
