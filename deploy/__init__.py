"""How to run nodeshare: the bundled broker launcher, compose file and local scripts."""
