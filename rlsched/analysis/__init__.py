"""Reading run and profile folders: replay in the simulator, figures, reports (no torch imports)."""
