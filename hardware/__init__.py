"""In-tree accelerator plugins, registered in the ``deepinfer.hardware`` entry-point group."""
