# Sourced by link/hot-first.sh, link/check.sh and link/record-hot-functions.sh.

# Reads symbol names, one per line, and prints each one's key: its demangled name (Rust's v0
# scheme spells out a generic function's type arguments) without the crates' disambiguating
# hashes, which change with the features, the dependencies and the compiler. Names that are
# not mangled (C's) are their own key, but for the version ring prefixes its C and assembly
# functions with (ring_core_0_17_14_), dropped too.
symbol_keys() {
  c++filt | sed -E 's/\[[0-9a-f]{5,16}\]//g; s/^ring_core_[0-9_]+__/ring_core__/'
}

# Prints the keys list $1 names (link/hot-functions.txt's format: one a line, hottest first,
# `#` comments), each once, in its order.
listed_keys() {
  awk '$0 != "" && !/^#/ && !seen[$0]++' "$1"
}

# Prints each function binary $1 defines (with a size): its address and size (hex), its name
# and its key, tab-separated.
keyed_functions() {
  local functions
  functions=$(nm --defined-only -S "$1" | awk 'NF == 4 && $3 ~ /^[tTwW]$/ { print $1 "\t" $2 "\t" $4 }') ||
    return
  paste -d '\t' <(printf '%s\n' "$functions") <(printf '%s\n' "$functions" | cut -f 3 | symbol_keys)
}
