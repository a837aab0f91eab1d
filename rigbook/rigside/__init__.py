"""The code that runs on rigs: standard library only, copied there as it is."""
