"""The A/B ladder's defaults, in one place: its rows and the requests a row serves when none are
given, per device type. Kept free of torch: the pytest plugin's option help reads them at every
start, before anything needs the engine."""

# On a CPU the kernels exist only interpreted, so +kernels is left out there.
DEFAULT_LADDER = {"cuda": "baseline;+kernels;+fp8-head;+mtp", "cpu": "baseline;+fp8-head;+mtp"}
DEFAULT_REQUESTS = {"cuda": 1000, "cpu": 60}
