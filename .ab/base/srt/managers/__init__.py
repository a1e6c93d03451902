"""Request scheduling for the offline engine: Req, ScheduleBatch, Scheduler."""
