"""Group transports: generated groups from the generators straight to the trainer's inbox."""
