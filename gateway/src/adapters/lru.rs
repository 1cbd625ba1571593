//! The adapters one engine has, in least-recently-used order: which to unload before loading
//! another, and which requests share a load. Pure bookkeeping, no I/O: the engine's calls
//! are made by [`super::Adapters`], which settles their outcome here.
//!
//! Each adapter has a slot: loaded, or being loaded (one load for every request that wants it
//! meanwhile), the time it was last claimed, and how many requests hold it (in flight on the
//! engine, or waiting for its load). A slot has an id; a request gives back the slot it
//! claimed by that id, so a slot that was dropped and made again (a failed load retried) is
//! not given back by the requests of the old one.

use std::{collections::HashMap, sync::Arc};

/// What a claim found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Found {
    /// The engine has the adapter: dispatch.
    Loaded,
    /// A load is under way: wait for it.
    Loading,
    /// Neither: a slot was made, and the claimant starts the load.
    Absent,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Slot {
    id: u64,
    loaded: bool,
    /// The claim tick of its last use.
    used: u64,
    /// Requests holding it.
    in_use: usize,
}

/// One engine's adapters (see the module documentation).
#[derive(Debug, Default)]
pub(crate) struct Lru {
    tick: u64,
    next_id: u64,
    slots: HashMap<Arc<str>, Slot>,
}

impl Lru {
    fn tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    /// Claims `name` for one request: it is touched (the most recently used now) and held
    /// until [`Lru::release`] with the id returned. An adapter neither loaded nor loading gets
    /// a slot being loaded.
    pub(crate) fn claim(&mut self, name: &Arc<str>) -> (u64, Found) {
        let used = self.tick();
        if let Some(slot) = self.slots.get_mut(name) {
            slot.used = used;
            slot.in_use += 1;
            let found = if slot.loaded {
                Found::Loaded
            } else {
                Found::Loading
            };
            return (slot.id, found);
        }
        self.next_id += 1;
        let id = self.next_id;
        self.slots.insert(
            name.clone(),
            Slot {
                id,
                loaded: false,
                used,
                in_use: 1,
            },
        );
        (id, Found::Absent)
    }

    /// Gives back a claim of slot `id` of `name` (nothing when the slot is another by now).
    pub(crate) fn release(&mut self, name: &str, id: u64) {
        if let Some(slot) = self.slots.get_mut(name)
            && slot.id == id
        {
            slot.in_use = slot.in_use.saturating_sub(1);
        }
    }

    /// The adapters to unload so that, with `name` loaded, at most `max` are loaded or being
    /// loaded: the least recently used loaded ones that no request holds, oldest first. They
    /// leave the engine's slots at once (the caller unloads them). Fewer than needed when the
    /// others are all held: the engine then has more than `max` for a while.
    pub(crate) fn evict_for(&mut self, name: &str, max: usize) -> Vec<Arc<str>> {
        let count = self.slots.len() + usize::from(!self.slots.contains_key(name));
        let excess = count.saturating_sub(max.max(1));
        let mut idle: Vec<(u64, Arc<str>)> = self
            .slots
            .iter()
            .filter(|(n, s)| s.loaded && s.in_use == 0 && &***n != name)
            .map(|(n, s)| (s.used, n.clone()))
            .collect();
        idle.sort();
        let victims: Vec<Arc<str>> = idle.into_iter().take(excess).map(|(_, n)| n).collect();
        for v in &victims {
            self.slots.remove(v);
        }
        victims
    }

    /// The load of slot `id` of `name` ended: loaded, or dropped when it failed (its waiters
    /// fail with it; the next claim loads again).
    pub(crate) fn settle(&mut self, name: &str, id: u64, loaded: bool) {
        match self.slots.get_mut(name) {
            Some(slot) if slot.id == id && loaded => slot.loaded = true,
            Some(slot) if slot.id == id => {
                self.slots.remove(name);
            }
            _ => {}
        }
    }

    /// What the engine says it has (its `/v1/models`, in its order): adapters the slots did
    /// not have are loaded (and used now, in that order), a load under way for one it has is
    /// done, and loaded ones it does not list are forgotten.
    pub(crate) fn learn(&mut self, reported: &[Arc<str>]) {
        self.slots
            .retain(|name, slot| !slot.loaded || reported.contains(name));
        for name in reported {
            let used = self.tick();
            match self.slots.get_mut(name) {
                Some(slot) => slot.loaded = true,
                None => {
                    self.next_id += 1;
                    let id = self.next_id;
                    self.slots.insert(
                        name.clone(),
                        Slot {
                            id,
                            loaded: true,
                            used,
                            in_use: 0,
                        },
                    );
                }
            }
        }
    }

    /// Drops slot `id` of `name`, loaded, when the engine says it does not have it (another
    /// replica unloaded it); nothing when the slot is another by now (a load of it begun
    /// since) or still loading. Its holders give nothing back to the next slot.
    pub(crate) fn lose(&mut self, name: &str, id: u64) {
        if self.slots.get(name).is_some_and(|s| s.id == id && s.loaded) {
            self.slots.remove(name);
        }
    }

    /// Forgets `name` (it is being unloaded: it left the table); whether it was loaded.
    pub(crate) fn forget(&mut self, name: &str) -> bool {
        self.slots.remove(name).is_some_and(|s| s.loaded)
    }

    /// Whether the engine has `name` loaded.
    pub(crate) fn is_loaded(&self, name: &str) -> bool {
        self.slots.get(name).is_some_and(|s| s.loaded)
    }

    /// Whether slot `id` of `name` is still there (not forgotten because `name` left the
    /// table, nor replaced).
    pub(crate) fn holds(&self, name: &str, id: u64) -> bool {
        self.slots.get(name).is_some_and(|s| s.id == id)
    }

    /// Whether `name` is loaded or being loaded.
    pub(crate) fn has(&self, name: &str) -> bool {
        self.slots.contains_key(name)
    }

    /// The loaded adapters, least recently used first.
    pub(crate) fn loaded(&self) -> Vec<Arc<str>> {
        let mut loaded: Vec<(u64, Arc<str>)> = self
            .slots
            .iter()
            .filter(|(_, s)| s.loaded)
            .map(|(n, s)| (s.used, n.clone()))
            .collect();
        loaded.sort();
        loaded.into_iter().map(|(_, n)| n).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One step of a scenario on one engine.
    #[derive(Debug, Clone, Copy)]
    enum Step {
        /// A request claims the adapter; it should find this.
        Claim(&'static str, Found),
        /// The load of the adapter's slot ends.
        Settle(&'static str, bool),
        /// The oldest request still holding the adapter ends (its claim is given back).
        Release(&'static str),
        /// Before loading the adapter with `max` loaded at once, these are unloaded.
        Evict(&'static str, usize, &'static [&'static str]),
        /// The engine lists these.
        Learn(&'static [&'static str]),
        /// The loaded adapters, least recently used first.
        Loaded(&'static [&'static str]),
    }
    use Step::*;

    fn run(name: &str, steps: &[Step]) {
        let mut lru = Lru::default();
        let mut claims: HashMap<&str, Vec<u64>> = HashMap::new();
        for (i, step) in steps.iter().enumerate() {
            let at = format!("{name}, step {i}: {step:?}");
            match *step {
                Claim(n, want) => {
                    let (id, found) = lru.claim(&Arc::from(n));
                    assert_eq!(found, want, "{at}");
                    claims.entry(n).or_default().push(id);
                }
                Settle(n, ok) => {
                    let id = *claims[n].last().unwrap();
                    lru.settle(n, id, ok);
                }
                Release(n) => {
                    let ids = claims.entry(n).or_default();
                    assert!(!ids.is_empty(), "{at}: nothing to give back");
                    lru.release(n, ids.remove(0));
                }
                Evict(n, max, want) => {
                    let got = lru.evict_for(n, max);
                    let got: Vec<&str> = got.iter().map(|a| &**a).collect();
                    assert_eq!(got, want, "{at}");
                }
                Learn(names) => {
                    let names: Vec<Arc<str>> = names.iter().map(|n| Arc::from(*n)).collect();
                    lru.learn(&names);
                }
                Loaded(want) => {
                    let got = lru.loaded();
                    let got: Vec<&str> = got.iter().map(|a| &**a).collect();
                    assert_eq!(got, want, "{at}");
                }
            }
        }
    }

    #[test]
    fn scenarios() {
        let cases: &[(&str, &[Step])] = &[
            (
                "a first claim loads, the next ones find it loaded",
                &[
                    Claim("a", Found::Absent),
                    Claim("a", Found::Loading),
                    Evict("a", 2, &[]),
                    Settle("a", true),
                    Claim("a", Found::Loaded),
                    Loaded(&["a"]),
                ],
            ),
            (
                "the least recently used idle adapter makes room",
                &[
                    Claim("a", Found::Absent),
                    Settle("a", true),
                    Claim("b", Found::Absent),
                    Settle("b", true),
                    Release("a"),
                    Release("b"),
                    Claim("a", Found::Loaded),
                    Release("a"),
                    Loaded(&["b", "a"]),
                    Claim("c", Found::Absent),
                    Evict("c", 2, &["b"]),
                    Settle("c", true),
                    Loaded(&["a", "c"]),
                    Claim("b", Found::Absent),
                ],
            ),
            (
                "an adapter in use is not unloaded; the engine holds more for a while",
                &[
                    Claim("a", Found::Absent),
                    Settle("a", true),
                    Claim("b", Found::Absent),
                    Settle("b", true),
                    Release("b"),
                    Claim("c", Found::Absent),
                    Evict("c", 2, &["b"]),
                    Settle("c", true),
                    Claim("d", Found::Absent),
                    Evict("d", 1, &[]),
                    Release("a"),
                    Release("c"),
                    Evict("d", 1, &["a", "c"]),
                ],
            ),
            (
                "loads under way count against the bound but are never unloaded",
                &[
                    Claim("a", Found::Absent),
                    Claim("b", Found::Absent),
                    Settle("b", true),
                    Release("b"),
                    Claim("c", Found::Absent),
                    Evict("c", 2, &["b"]),
                ],
            ),
            (
                "a failed load drops its slot; the next claim loads again",
                &[
                    Claim("a", Found::Absent),
                    Claim("a", Found::Loading),
                    Settle("a", false),
                    Loaded(&[]),
                    Claim("a", Found::Absent),
                    Settle("a", true),
                    Loaded(&["a"]),
                ],
            ),
            (
                "the old slot's requests do not give back the new one",
                &[
                    Claim("a", Found::Absent),
                    Settle("a", false),
                    Claim("a", Found::Absent),
                    Settle("a", true),
                    Release("a"),
                    Evict("b", 1, &[]),
                    Release("a"),
                    Evict("b", 1, &["a"]),
                ],
            ),
            (
                "the engine's list: new ones loaded in its order, missing ones forgotten",
                &[
                    Claim("gone", Found::Absent),
                    Settle("gone", true),
                    Release("gone"),
                    Claim("pending", Found::Absent),
                    Learn(&["x", "y", "pending"]),
                    Loaded(&["pending", "x", "y"]),
                    Claim("x", Found::Loaded),
                    Release("x"),
                    Release("pending"),
                    Evict("z", 2, &["pending", "y"]),
                ],
            ),
        ];
        for (name, steps) in cases {
            run(name, steps);
        }
    }

    #[test]
    fn has_and_is_loaded() {
        let mut lru = Lru::default();
        let a: Arc<str> = Arc::from("a");
        let (id, _) = lru.claim(&a);
        assert!(lru.has("a") && !lru.is_loaded("a"));
        lru.settle("a", id, true);
        assert!(lru.is_loaded("a"));
        assert!(!lru.has("b"));
        assert!(lru.forget("a") && !lru.has("a") && !lru.forget("a"));
    }

    #[test]
    fn a_lost_adapter_is_loaded_again_once() {
        let mut lru = Lru::default();
        let a: Arc<str> = Arc::from("a");
        let (first, _) = lru.claim(&a);
        lru.settle("a", first, true);
        let (second, found) = lru.claim(&a);
        assert_eq!((second, found), (first, Found::Loaded));
        // Both requests get the engine's 404: the first drops the slot, and its next claim
        // starts the load; the second's drop leaves that load alone and shares it.
        lru.lose("a", first);
        assert!(!lru.has("a"));
        let (again, found) = lru.claim(&a);
        assert_eq!(found, Found::Absent);
        lru.lose("a", second);
        assert!(lru.holds("a", again));
        assert_eq!(lru.claim(&a), (again, Found::Loading));
        // A slot still loading is not dropped either.
        lru.lose("a", again);
        assert!(lru.holds("a", again));
        // The old slot's requests give nothing back to the new one.
        lru.release("a", first);
        lru.release("a", second);
        lru.settle("a", again, true);
        lru.release("a", again);
        assert_eq!(
            lru.evict_for("b", 1),
            Vec::<Arc<str>>::new(),
            "one claim holds it"
        );
    }

    #[test]
    fn a_slot_forgotten_while_loading_is_no_longer_held() {
        let mut lru = Lru::default();
        let a: Arc<str> = Arc::from("a");
        let (id, _) = lru.claim(&a);
        assert!(lru.holds("a", id));
        // Retired (left the table) before its load ran; a later claim is another slot.
        assert!(!lru.forget("a"));
        assert!(!lru.holds("a", id));
        let (again, _) = lru.claim(&a);
        assert!(again != id && lru.holds("a", again) && !lru.holds("a", id));
    }
}
