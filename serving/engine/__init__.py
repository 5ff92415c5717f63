"""The P / RLD / MD services of cluster.proto: one engine and one engine thread per process."""
