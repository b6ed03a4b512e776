# The fedmesh wire protocol: every message between two fedmesh processes is
# one `Message`, preceded on the wire by the fixed envelope of protocol/wire.h
# (magic, protocol version, message kind, byte length). Fields are only ever
# added, never renumbered or retyped; the protocol version rises when a peer
# must know of a change to talk correctly.
@0x90dd2baa0c828ef2;

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("fedmesh::wire");

const protocolVersion :UInt16 = 4;  # 2: secure aggregation (SecAggUp, SecAggDown); 3: UpdateHeader.peer;
                                    # 4: sealed updates (UpdateHeader.sealed, UpdateSeal)
const minProtocolVersion :UInt16 = 1;  # the oldest version this build still speaks

enum Role {
  site @0;
  aggregator @1;
  peer @2;
}

# Tensor encodings of the update codec (protocol/codec.h describes the bytes).
enum TensorEncoding {
  denseF32 @0;
  denseBf16 @1;
  denseF16 @2;
  sparseF32 @3;
  sparseF16 @4;
  sparseInt8 @5;
  blockInt8 @6;
  blockInt4 @7;
  sparseBitmapF32 @8;
  sparseBitmapF16 @9;
  sparseBitmapInt8 @10;
  dctSign @11;
}

enum DType {
  f32 @0;
  bf16 @1;
  f16 @2;
}

struct Capabilities {
  encodings @0 :List(TensorEncoding);   # encodings this peer decodes
  dtypes @1 :List(DType);               # compute dtypes it trains in
  maxMessageBytes @2 :UInt32;           # largest message it accepts
  chunkBytes @3 :UInt32;                # chunk size it sends
}

# First message on every connection, from the side that dialled.
struct Hello {
  federation @0 :Text;
  siteName @1 :Text;
  role @2 :Role;
  protocolVersion @3 :UInt16;      # the newest version the sender speaks
  minProtocolVersion @4 :UInt16;   # the oldest it still speaks
  capabilities @5 :Capabilities;
}

# The answer to Hello: the version both will use (the highest both speak)
# and the capabilities in common. A peer with no version in common gets a
# Reject with code versionUnsupported instead.
struct Welcome {
  siteName @0 :Text;
  role @1 :Role;
  protocolVersion @2 :UInt16;
  capabilities @3 :Capabilities;
  round @4 :UInt64;
  modelVersion @5 :UInt64;
}

struct RoundAnnounce {
  round @0 :UInt64;
  modelVersion @1 :UInt64;
  modelHash @2 :Data;          # BLAKE2b-256 of the model's chunks
  deadlineUnixMs @3 :UInt64;
  localSteps @4 :UInt32;
  selected @5 :Bool;           # the recipient is sampled for this round (always, when asynchronous)
  parentHash @6 :Data;         # the hash of version modelVersion - 1
  asynchronous @7 :Bool;       # sites train continuously (FedBuff / FedAsync)
  roundOpen @8 :Bool;          # updates for `round` are being taken
  finished @9 :Bool;           # the federation has run its rounds: sites may stop
  secureAggregation @10 :Bool; # private mode: updates go through SecAggUp, never UpdateHeader
  tokenizer @11 :Text;         # language models: the BPE tokenizer's fingerprint ("fnv1a64:<16 hex>",
                               # train/data/bpe_tokenizer.h); "" (and absent, from older builds): bytes.
                               # A site that reads text with another refuses to take part.
  dataSchema @12 :Text;        # image and table models: the fingerprint of the data schema the federation's
                               # model is built for (train/data/dataset.h DataSchema); "" (and absent): not
                               # announced. A site whose data has another schema refuses to take part.
  modelSpec @13 :Text;         # the fingerprint of the federation's model spec (train/model_spec.h: a built-in
                               # model or a spec file); "" (and absent, from older builds): not announced.
                               # A site built from another spec refuses to take part.
}

# One tensor of an update or a model: its shape in the manifest and how it is
# encoded. The receiver checks name and shape against its own manifest.
struct TensorDescriptor {
  name @0 :Text;
  shape @1 :List(UInt64);
  encoding @2 :TensorEncoding;
  blockSize @3 :UInt32;        # block encodings only
}

# A piece of one tensor, decodable on its own (protocol/codec.h).
struct TensorSegment {
  tensor @0 :UInt32;           # index into the descriptors
  encoding @1 :TensorEncoding;
  offset @2 :UInt64;
  count @3 :UInt64;
  nnz @4 :UInt64;
  blockSize @5 :UInt32;
  indices @6 :Data;
  values @7 :Data;
  scales @8 :Data;
}

struct ModelRequest {
  version @0 :UInt64;
  fromChunk @1 :UInt32;        # resume: the first chunk still missing
  trustedVersion @2 :UInt64;   # the newest version whose hash the requester holds
}

struct ModelChunk {
  version @0 :UInt64;
  modelHash @1 :Data;
  chunkIndex @2 :UInt32;
  chunkCount @3 :UInt32;
  tensors @4 :List(TensorDescriptor);   # in chunk 0 only
  segments @5 :List(TensorSegment);
  parentHash @6 :Data;
  # In chunk 0 only: the hashes of versions trustedVersion + 1 .. version, so
  # that the requester can check the chain from the hash it holds.
  chainHashes @7 :List(Data);
}

# A site's local evaluation after its training for a round.
struct SiteReport {
  round @0 :UInt64;
  baseVersion @1 :UInt64;
  trainLoss @2 :Float64;
  localLoss @3 :Float64;
  localAccuracy @4 :Float64;
  examples @5 :UInt64;
  regression @6 :Bool;         # a regression task: localR2 and localMae hold its metrics (accuracy is 0)
  localR2 @7 :Float64;         # R² on the site's held-out part (in (-inf, 1])
  localMae @8 :Float64;        # mean absolute error there, in the target's units
}

# Opens (or, resent, resumes) the transfer of one update. Signed: the
# signature covers federation, round, baseVersion, sender, recipient,
# sequence, sampleCount, the hash of `tensors` and the list of chunk hashes
# (crypto/update_signature.h), so every chunk is checked on arrival.
struct UpdateHeader {
  federation @0 :Text;
  round @1 :UInt64;
  baseVersion @2 :UInt64;
  sender @3 :Text;
  recipient @4 :Text;
  sequence @5 :UInt64;         # per sender key, strictly increasing; sites use the Unix time in
                               # microseconds (or the last sequence + 1 if that is larger), and a
                               # receiver refuses one more than a day ahead of its own clock
  sampleCount @6 :UInt64;
  tensors @7 :List(TensorDescriptor);
  chunkCount @8 :UInt32;
  chunkHashes @9 :List(Data);  # the chunkHash (below) of each chunk's segments
  signature @10 :Data;         # Ed25519, 64 bytes
  # Gossip updates only (absent in an update to an aggregator): what the
  # update is beside its tensors. Signed with the other fields, under its
  # own signature domain (crypto/update_signature.h).
  peer @11 :PeerUpdate;
  # Which hash chunkHashes are (signed: crypto/update_signature.h). Absent,
  # BLAKE2b-256, as senders before it wrote; fedmesh's senders write blake2bp.
  chunkHash @12 :ChunkHashKind;
  # A sealed update's chunks are made while the first ones are sent: this
  # header carries no chunkCount, chunkHashes or signature (they must be
  # empty), the chunks follow as they are made, and an UpdateSeal after them
  # carries the chunk hashes and the signature, over the same fields as a
  # header that carries them. Nothing of it is accepted before the seal
  # verifies. Version 4.
  sealed @13 :Bool;
}

# The end of a sealed update (UpdateHeader.sealed): its chunk count, every
# chunk's hash (of UpdateHeader.chunkHash's kind) and the Ed25519 signature
# a header carrying them would have had.
struct UpdateSeal {
  sequence @0 :UInt64;
  chunkCount @1 :UInt32;
  chunkHashes @2 :List(Data);
  signature @3 :Data;
}

enum ChunkHashKind {
  blake2b @0;    # BLAKE2b-256
  blake2bp @1;   # BLAKE2bp-256: four BLAKE2b leaves and a root (crypto/tree_hash.h)
}

enum PeerUpdateKind {
  share @0;          # a share of the sender's model
  catchUpSlice @1;   # a slice of its model that a member asked for
  replicaUpdate @2;  # its compressed update of round `round` (merge rule replicas): every member
                     # applies each (sender, round) once
}

struct PeerUpdate {
  kind @0 :PeerUpdateKind;
  weight @1 :Float64;          # a share's push-sum weight (pairwise: 1)
  slice @2 :UInt32;            # a catch-up slice: slice `slice` of `slices`
  slices @3 :UInt32;
}

struct UpdateChunk {
  sequence @0 :UInt64;
  chunkIndex @1 :UInt32;
  segments @2 :List(TensorSegment);
}

# Acknowledges an update header or chunk. `nextChunk` is the first chunk the
# receiver does not yet hold: a sender that reconnects resumes from it.
struct Ack {
  sequence @0 :UInt64;
  nextChunk @1 :UInt32;
  complete @2 :Bool;           # every chunk held, verified and committed
}

enum RejectCode {
  malformed @0;          # does not parse, or fields inconsistent
  tooLarge @1;           # over the message size limit
  unauthenticated @2;    # sender field does not match the transport identity
  badSignature @3;
  replayed @4;           # sequence not above the last accepted one
  wrongShape @5;         # tensors do not match the model's manifest
  nonFinite @6;          # NaN or Inf in a value
  versionUnsupported @7;
  rateLimited @8;
  wrongRound @9;         # round or base version the receiver will not take
  tooManyChunks @10;
  unknownTransfer @11;   # a chunk or seal with no accepted header
  badChunkHash @12;
  wrongRecipient @13;
  wrongFederation @14;
  busy @15;              # too many transfers in flight
  privateMode @16;       # a plain update to a federation in private mode (secure aggregation only)
  notStored @17;         # the receiver could not make the update durable; nothing was kept: send it again later
  sequenceAhead @18;     # sequence further ahead of the receiver's clock than it allows (see UpdateHeader.sequence)
  tooManySamples @19;    # sampleCount above the receiver's cap for the sender
  wrongRole @20;         # a Hello whose role the receiver does not take
  outOfRange @21;        # a value outside its documented range (a SiteReport's accuracy, a round ahead)
  revoked @22;           # the sender's key was taken off the roster: final, the sender stops
}

struct Reject {
  sequence @0 :UInt64;
  code @1 :RejectCode;
  text @2 :Text;
  # replayed: the last sequence the receiver accepted from this sender (0:
  # not said). A sender whose counter fell behind it (a crash lost the
  # sequences it used last, and its clock went back) moves above it.
  lastAccepted @3 :UInt64;
}

struct Heartbeat {
  sentUnixMs @0 :UInt64;
  round @1 :UInt64;
  modelVersion @2 :UInt64;
}

# Membership (SWIM-style, used by the gossip issue).
enum MemberStatus {
  alive @0;
  suspect @1;
  dead @2;
  left @3;
}

struct MembershipDelta {
  site @0 :Text;
  status @1 :MemberStatus;
  incarnation @2 :UInt64;
  accuser @3 :Text;            # suspect: the member whose probe failed
}

struct Ping {
  probe @0 :UInt64;
  deltas @1 :List(MembershipDelta);
  version @2 :UInt64;          # the sender's model version (gossip staleness)
}

# Ask the receiver to ping `target` on the sender's behalf.
struct PingReq {
  probe @0 :UInt64;
  target @1 :Text;
  deltas @2 :List(MembershipDelta);
  version @3 :UInt64;
}

struct PingAck {
  probe @0 :UInt64;
  target @1 :Text;             # who answered (the pinged site)
  deltas @2 :List(MembershipDelta);
  version @3 :UInt64;
}

# Gossip anti-entropy: a node that joins late or returns from a crash asks
# each of several donors for one slice of the model (slice of slices, by
# element over the flattened model); the donor answers with a signed update
# holding its model's values in that slice.
struct CatchUpRequest {
  slice @0 :UInt32;
  slices @1 :UInt32;
}

# Gossip replicas: a member that lacks the recipient's update of `round`
# (lost on the way, or sent while it was down) asks for it again; the
# recipient answers with that update, signed anew, if it still keeps it.
# A member that holds part of it names the transfer (`sequence`, 0: none)
# and the chunks it holds (`haveChunks`, bit i of byte i/8 for chunk i):
# the recipient resends that very header and only the chunks missing.
struct UpdateRequest {
  round @0 :UInt64;
  sequence @1 :UInt64;
  haveChunks @2 :Data;
}

# Gossip replicas: the sender holds every update of the recipient's rounds
# below `below` that it can still take (its 16-round window). A peer that
# has done its rounds leaves only once every reachable member has said so
# for all of its rounds: a lost update is never left behind by a sender
# that left.
struct ReplicaHolds {
  below @0 :UInt64;
}

# Secure aggregation (crypto/secure_aggregation.h): a site's messages go up
# to the aggregator, each answered by a SecAggDown with the session as that
# site sees it. Sites never talk to each other directly: what one site has
# for another (signed keys, encrypted shares, signatures) travels through
# the aggregator, which cannot read or forge it.
enum SecAggPhase {
  advertise @0;
  shareKeys @1;
  maskedInput @2;
  consistency @3;
  unmask @4;
  done @5;
  aborted @6;
}

struct SecAggAdvertisement {
  site @0 :Text;
  cipherPublic @1 :Data;       # X25519, 32 bytes: shares are encrypted to it
  maskPublic @2 :Data;         # X25519, 32 bytes: pairwise masks
  signature @3 :Data;          # Ed25519 by the site's roster identity, 64 bytes
}

struct SecAggShare {
  from @0 :Text;
  to @1 :Text;
  ciphertext @2 :Data;
}

struct SecAggSignature {
  site @0 :Text;
  signature @1 :Data;
}

struct SecAggReveal {
  owner @0 :Text;
  maskKey @1 :Bool;            # a share of owner's mask key (owner dropped), else of its self-mask seed
  point @2 :UInt8;
  share @3 :Data;              # 32 bytes
}

struct SecAggUp {
  round @0 :UInt64;
  session @1 :Text;            # empty in a join
  union {
    join @2 :Void;             # take part in the round's session (or ask how it stands)
    poll @3 :Void;             # what does the session need from me now?
    advertise @4 :SecAggAdvertisement;
    shares @5 :List(SecAggShare);
    masked @6 :SecAggMasked;
    consistency @7 :Data;      # the signature over the survivors
    reveals @8 :List(SecAggReveal);
  }
}

struct SecAggMasked {
  offset @0 :UInt64;           # the first word of this piece
  words @1 :Data;              # little-endian uint32 words of y
}

struct SecAggDown {
  round @0 :UInt64;
  session @1 :Text;            # empty: no session for this round now
  phase @2 :SecAggPhase;       # the phase the session is collecting
  member @3 :Bool;             # the recipient is (still) in the session
  answered @4 :Bool;           # the recipient has answered this phase
  threshold @5 :UInt32;
  length @6 :UInt64;           # words of every input
  invited @7 :UInt32;          # sites asked to take part
  baseVersion @8 :UInt64;      # the model version the inputs are deltas of
  clip @9 :Float32;            # each site clips its update to this L2 norm
  fractionBits @10 :UInt8;     # fixed point: round(v * 2^fractionBits) in Z_2^32
  advertisements @11 :List(SecAggAdvertisement);  # shareKeys: U1
  shares @12 :List(SecAggShare);                   # maskedInput: the recipient's
  maskedNext @13 :UInt64;      # maskedInput: the next word expected from the recipient
  alive @14 :List(Text);       # consistency, unmask, done: U3
  dropped @15 :List(Text);     # unmask: U2 minus U3
  signatures @16 :List(SecAggSignature);           # unmask: U4's
  reason @17 :Text;            # aborted, or why the recipient is not a member
}

# Normalization statistics a federation computes together before it trains
# (`fedmesh stats serve` / `fedmesh stats send`, federation/stats_exchange.h):
# per numeric feature (or image channel) the count of values, their sum and
# their sum of squares over the sender's training part; never a row.
struct FeatureSum {
  name @0 :Text;
  count @1 :UInt64;
  sum @2 :Float64;
  sumSquares @3 :Float64;
}

struct StatsReport {           # site -> aggregator: this site's sums
  federation @0 :Text;
  kind @1 :Text;               # "table" or "images"
  features @2 :List(FeatureSum);
  masked @3 :Bool;             # private mode: names only; the sums follow by secure aggregation
}

struct StatsMerged {           # aggregator -> site: everyone's sums, added up
  federation @0 :Text;
  kind @1 :Text;
  parts @2 :UInt32;            # how many sites' sums; 0: still waiting (see `waiting`)
  features @3 :List(FeatureSum);
  waiting @4 :Text;            # parts 0: who has not sent yet
  join @5 :Bool;               # parts 0, private mode: every site named its features; join the
                               # secure-aggregation session (SecAggUp) with the masked sums
}

struct Message {
  union {
    hello @0 :Hello;
    welcome @1 :Welcome;
    roundAnnounce @2 :RoundAnnounce;
    modelRequest @3 :ModelRequest;
    modelChunk @4 :ModelChunk;
    updateHeader @5 :UpdateHeader;
    updateChunk @6 :UpdateChunk;
    ack @7 :Ack;
    reject @8 :Reject;
    heartbeat @9 :Heartbeat;
    ping @10 :Ping;
    pingReq @11 :PingReq;
    pingAck @12 :PingAck;
    siteReport @13 :SiteReport;
    catchUpRequest @14 :CatchUpRequest;
    secAggUp @15 :SecAggUp;
    secAggDown @16 :SecAggDown;
    statsReport @17 :StatsReport;
    statsMerged @18 :StatsMerged;
    updateRequest @19 :UpdateRequest;
    replicaHolds @20 :ReplicaHolds;
    updateSeal @21 :UpdateSeal;
  }
}
