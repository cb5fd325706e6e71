//! The guest memory maps that the requests in flight of one IOThread hold.
//!
//! A request must keep the memory map it was parsed against alive until it
//! is retired: the kernel or a pool worker may access its buffers, and the
//! queue layer writes its status byte and used entry through it, while the
//! control plane may replace the map (SET_MEM_TABLE, ADD_MEM_REG,
//! REM_MEM_REG) or the frontend go away. Each request holding its own
//! `Arc<GuestMem>` costs two locked instructions per request (the clone and
//! the drop), and a locked instruction waits until every store before it
//! has left the store buffer: right after a request is published, those
//! are the used ring's stores, which wait for the driver's cache lines.
//! With the IOThread on one CPU and the driver on another, that wait was
//! 7-14% of the thread's samples at QD16 (`perf record`).
//!
//! Here the thread holds each map once, with a plain count of the requests
//! that use it. A map whose requests are all retired is let go
//! ([`HeldMaps::release_idle`]) at the end of the pass, unless it is the
//! one held last, and before the thread sleeps with no timeout, whichever
//! it is. The map in use stays held from one request to the next while
//! the thread is awake: its `Arc` is cloned once per wake-up, not once per
//! request. A map the control plane replaced, or the map of a frontend
//! that went away, is let go once another map is held after it, or when
//! the thread sleeps: an idle thread holds none.

use std::sync::Arc;

use super::GuestMem;

/// Which held map a request uses (an index into [`HeldMaps`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct MapId(u32);

/// A map and the requests in flight that use it.
struct Held {
    map: Arc<GuestMem>,
    requests: usize,
}

/// The maps of one IOThread's requests in flight (see the module's
/// documentation).
#[derive(Default)]
pub(super) struct HeldMaps {
    /// By [`MapId`]; None: free for another map.
    held: Vec<Option<Held>>,
    /// The map held last: the next request's, nearly always.
    last: usize,
}

impl HeldMaps {
    /// Holds `map` for one more request. The slot held last is nearly
    /// always the next request's; otherwise a thread serves a few maps at a
    /// time (one per frontend with a queue here), and a scan finds it.
    #[inline(always)]
    pub fn hold(&mut self, map: &Arc<GuestMem>) -> MapId {
        if let Some(Some(h)) = self.held.get_mut(self.last) {
            if Arc::ptr_eq(&h.map, map) {
                h.requests += 1;
                return MapId(self.last as u32);
            }
        }
        self.hold_other(map)
    }

    /// [`HeldMaps::hold`] in the slot that holds `map`, or in the first free
    /// one, given it.
    #[inline(never)]
    fn hold_other(&mut self, map: &Arc<GuestMem>) -> MapId {
        let holds = |h: &Option<Held>| h.as_ref().is_some_and(|h| Arc::ptr_eq(&h.map, map));
        let i = match self.held.iter().position(holds) {
            Some(i) => i,
            None => {
                let held = Some(Held {
                    map: map.clone(),
                    requests: 0,
                });
                match self.held.iter().position(Option::is_none) {
                    Some(i) => {
                        self.held[i] = held;
                        i
                    }
                    None => {
                        self.held.push(held);
                        self.held.len() - 1
                    }
                }
            }
        };
        if let Some(h) = &mut self.held[i] {
            h.requests += 1;
        }
        self.last = i;
        MapId(i as u32)
    }

    /// The map of `id`: held by a request in flight (or, the one in use,
    /// kept until the thread sleeps).
    #[inline(always)]
    pub fn get(&self, id: MapId) -> Option<&Arc<GuestMem>> {
        self.held.get(id.0 as usize)?.as_ref().map(|h| &h.map)
    }

    /// One request that held `id` is retired. The map stays until
    /// [`HeldMaps::release_idle`].
    #[inline(always)]
    pub fn release(&mut self, id: MapId) {
        if let Some(Some(h)) = self.held.get_mut(id.0 as usize) {
            h.requests = h.requests.saturating_sub(1);
        }
    }

    /// Lets go of the maps no request in flight holds; with `all` false,
    /// but the one held last.
    pub fn release_idle(&mut self, all: bool) {
        for (i, h) in self.held.iter_mut().enumerate() {
            if h.as_ref().is_some_and(|h| h.requests == 0) && (all || i != self.last) {
                *h = None;
            }
        }
    }

    /// Maps held now.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.held.iter().flatten().count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map() -> Arc<GuestMem> {
        Arc::new(GuestMem::default())
    }

    #[test]
    fn a_map_is_held_once_and_let_go_when_the_thread_sleeps() {
        let mut maps = HeldMaps::default();
        let a = map();
        let x = maps.hold(&a);
        assert_eq!(maps.hold(&a), x);
        assert_eq!(Arc::strong_count(&a), 2, "held once for two requests");
        maps.release(x);
        maps.release_idle(true);
        assert_eq!(Arc::strong_count(&a), 2, "one request still holds it");
        maps.release(x);
        maps.release_idle(false);
        assert!(
            Arc::ptr_eq(maps.get(x).unwrap(), &a),
            "the last one held stays"
        );
        assert_eq!(maps.hold(&a), x, "and serves the next request");
        maps.release(x);
        maps.release_idle(true);
        assert_eq!(Arc::strong_count(&a), 1, "let go before the thread sleeps");
        assert_eq!(maps.len(), 0);
    }

    #[test]
    fn maps_of_several_frontends_are_held_apart_and_slots_reused() {
        let mut maps = HeldMaps::default();
        let (a, b, c) = (map(), map(), map());
        let x = maps.hold(&a);
        let y = maps.hold(&b);
        assert_ne!(x, y);
        assert!(Arc::ptr_eq(maps.get(y).unwrap(), &b));
        maps.release(x);
        maps.release_idle(false);
        assert_eq!(Arc::strong_count(&a), 1, "idle and not the last one held");
        assert_eq!(maps.hold(&c), x, "the free slot is reused");
        assert!(Arc::ptr_eq(maps.get(x).unwrap(), &c));
        assert!(Arc::ptr_eq(maps.get(y).unwrap(), &b));
        assert_eq!(maps.len(), 2);
    }
}
