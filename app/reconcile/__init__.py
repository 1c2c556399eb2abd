"""The reconciler: short passes over SQL state that put back what crashes, kills and lost
messages leave."""
