"""Benchmarks of this project (speed, accuracy and search-efficiency targets): each script prints
its figures and appends them with provenance under ``results/``. The measurement library they
use is the package above (``archsearch.benchmarks``)."""
