"""stagemesh's library: everything every service imports. No sockets in model code, no services here."""
