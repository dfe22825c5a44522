# Sourced at the start of every device call (see pack.sh): unpacks the site packages and the kernel
# cache, and puts this checkout on the path with its entry points.
if [ ! -d /tmp/site/tilelang ]; then
  mkdir -p /tmp/site && tar xJf .gpu/site_k.tar.xz -C /tmp/site && ln -sf libz3.so.4.15 /tmp/site/z3/lib/libz3.so
fi
cp -r .gpu/dist/* /tmp/site/
export PYTHONPATH=/tmp/site:$PWD
mkdir -p /tmp/tlc && tar xJf .gpu/tlcache.tar.xz -C /tmp/tlc
export TILELANG_CACHE_DIR=/tmp/tlc/tlcache
