"""wavefarm: what every process shares (settings, state, stores, audio, host features, interfaces)."""
