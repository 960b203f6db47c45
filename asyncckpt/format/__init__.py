"""The on-disk format: data-file layout, manifest (in one file, or a root and rank parts),
object tree, tiling of global tensors, and the names a root holds (step directories,
node directories, `latest`, tmp names); how a root is read and written is storage/.

Defined once for the writer that makes these bytes and the readers that check them; no
torch is imported here (the writer process never imports it)."""
