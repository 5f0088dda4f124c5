"""Real services for tests (Prometheus, the rotel OTLP receiver, headless Chromium), installed
on demand with apt-get / pip and started on free loopback ports."""
