"""Privacy accounting for DP-SGD and DP-BandMF (not yet built; see the README roadmap)."""
