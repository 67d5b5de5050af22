"""Reports: metrics files, the live progress display, timelines, HTML reports and trackers."""
