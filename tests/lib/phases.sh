# shellcheck shell=bash
# Phase timings of `.ci/run` and `tests/run-tests`: each phase appends one line to the file named
# by $HEARTH_PHASES (tab-separated: name, seconds, exit status, start as seconds since the epoch)
# and `phases_table` prints them as a table. Sourced, never executed.
#
# The outermost script sets HEARTH_PHASES (and prints the table at its end); a script it calls
# appends to the same file, so one table covers a whole CI run. Phases may overlap (a background
# build, test groups run concurrently): the table's `start` column says when each began, relative
# to the first, and the last line gives the wall time of everything listed.

# phases_init: starts a table (exports HEARTH_PHASES) unless an outer script already did; sets
# PHASES_OWNER to 1 when this caller owns it (and so should print it), to 0 otherwise.
phases_init() {
  if [[ -n "${HEARTH_PHASES:-}" && -f "$HEARTH_PHASES" ]]; then
    PHASES_OWNER=0
    return
  fi
  HEARTH_PHASES="$(mktemp "${TMPDIR:-/tmp}/hearth-phases.XXXXXX")"
  export HEARTH_PHASES
  PHASES_OWNER=1
}

# phase_record <name> <seconds> <status> <start epoch>
phase_record() {
  [[ -n "${HEARTH_PHASES:-}" ]] || return 0
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$HEARTH_PHASES"
}

# phase <name> <command...>: runs the command, records its wall time and exit status, and returns
# that status.
phase() {
  local name="$1" start rc=0 t0
  shift
  start="$(date +%s)"
  t0=$SECONDS
  "$@" || rc=$?
  phase_record "$name" "$((SECONDS - t0))" "$rc" "$start"
  return "$rc"
}

# phases_from_cargo_log <prefix> <log>: one phase per test binary of a `cargo test` log, from its
# `Running <target>` line and the `finished in <s>s` of the result that follows, named after the
# crate (cargo runs a package's unit tests first, then its integration tests, so the last crate
# whose unit tests ran names the files after it). The binaries ran one after another inside the
# phase that ran cargo, so these rows have no start of their own.
phases_from_cargo_log() {
  local prefix="$1" log="$2"
  [[ -f "$log" ]] || return 0
  awk -v prefix="$prefix" '
    /^ *Running / {
      name = $2; sub(/^tests\//, "", name)
      if (name == "unittests") {
        # the crate: the binary in (target/debug/deps/<crate>-<hash>)
        crate = $NF; sub(/\)$/, "", crate); sub(/.*\//, "", crate); sub(/-[0-9a-f]+$/, "", crate)
        name = crate " (unit tests)"
      } else if (crate != "") {
        name = crate ": " name
      }
      next
    }
    /^ *Doc-tests / { name = "doc-tests " $2; next }
    /^test result: / && name != "" {
      secs = $0; sub(/.*finished in /, "", secs); sub(/s$/, "", secs)
      status = ($3 == "ok.") ? 0 : 1
      printf "%s%s\t%d\t%d\t%s\n", prefix, name, secs + 0.5, status, "-"
      name = ""
    }' "$log" >>"$HEARTH_PHASES"
}

# phases_table: prints the recorded phases (to stdout): name, seconds, status, start offset.
phases_table() {
  [[ -n "${HEARTH_PHASES:-}" && -s "$HEARTH_PHASES" ]] || return 0
  awk -F '\t' '
    { name[NR] = $1; secs[NR] = $2; rc[NR] = $3; st[NR] = $4
      if ($4 != "-") { if (first == "" || $4 < first) first = $4; end = $4 + $2; if (end > last) last = end }
      if (length($1) > width) width = length($1) }
    END {
      if (width < 5) width = 5
      printf "\n== phases (seconds; start: seconds after the first phase began)\n"
      printf "%-" width "s %8s %8s  %s\n", "phase", "seconds", "start", "status"
      for (i = 1; i <= NR; i++) {
        start = (st[i] == "-") ? "" : st[i] - first
        printf "%-" width "s %8d %8s  %s\n", name[i], secs[i], start, (rc[i] == 0 ? "ok" : "failed (" rc[i] ")")
      }
      if (first != "") printf "%-" width "s %8d\n", "wall time, first start to last end", last - first
    }' "$HEARTH_PHASES"
}
