"""Model folders: load the released token2wav layout safely (load), write random
weights in it (write), read flow.yaml without executing it (flow_yaml), check a folder (check)."""
