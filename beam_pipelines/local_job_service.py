"""Beam's Python job service for the PortableRunner (`apache_beam.runners.portability.local_job_service_main`,
same options), with its data plane flushing by size only.

The job service runs each job with Beam's FnApiRunner, whose streams to the SDK workers flush on a
timer that clears what was written while it sent (`pipeline.flush_data_by_size`): started this way,
it sends every byte.

    python -m madp.beam.local_job_service --port 8099
"""

from __future__ import annotations

import logging
import signal
import sys

from apache_beam.runners.portability import local_job_service_main

from madp.beam.pipeline import flush_data_by_size

if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *args: sys.exit(0))
    logging.basicConfig(level=logging.INFO)
    flush_data_by_size()
    local_job_service_main.run(sys.argv[1:])
