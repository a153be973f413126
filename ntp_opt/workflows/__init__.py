"""The workflows layer: re-planning after events, trace simulation, spares and availability."""
