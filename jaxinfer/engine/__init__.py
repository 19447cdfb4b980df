"""Engine: the host core (scheduler, requests, outputs), the device step and the front door."""
