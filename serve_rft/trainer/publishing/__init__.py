"""Publishing: new policy versions handed to the synchronizer, and the trainer states saved."""
