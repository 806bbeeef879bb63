"""What people look at: the plan viewer (a small HTTP server over a run's records), SVG pictures of SP plans and
pipeline schedules, and the Grafana dashboard for the exported metrics. Reads records, never the control plane."""
