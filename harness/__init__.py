"""Infrastructure the tests and the benchmarks share (not part of the hvd_dgc package):
model shapes, horovodrun launchers, the emulated slow link and the emulated hosts.

Tests and benchmarks both import from here, never from each other."""
