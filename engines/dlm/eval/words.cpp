// The embedded word lists (words.h). Written for sparsa; lowercase, distinct, sorted.
#include "words.h"

namespace sparsa::eval {

namespace {

constexpr std::string_view kAdjectives[] = {
  "able", "absent", "active", "actual", "afraid", "agile", "alert", "alive", "amber", "ancient", "angry",
  "annual", "anxious", "arctic", "aware", "awful", "basic", "bitter", "blank", "bold", "bored", "brave",
  "brief", "bright", "brisk", "broad", "broken", "bumpy", "busy", "calm", "candid", "careful", "casual",
  "central", "certain", "cheap", "cheerful", "chief", "chilly", "civil", "classic", "clean", "clear",
  "clever", "close", "cloudy", "clumsy", "coastal", "cold", "comfy", "common", "complex", "cool", "cosmic",
  "crazy", "crisp", "crooked", "cruel", "curious", "curly", "cute", "daily", "damp", "dark", "dear", "decent",
  "deep", "dense", "direct", "dirty", "distant", "divine", "dizzy", "double", "dry", "dull", "dusty", "eager",
  "early", "earnest", "easy", "elder", "electric", "elegant", "empty", "endless", "equal", "even", "exact",
  "exotic", "expert", "faint", "fair", "false", "famous", "fancy", "far", "fast", "fatal", "fertile",
  "fierce", "final", "fine", "firm", "flat", "fluffy", "fond", "foreign", "formal", "fragile", "free",
  "fresh", "friendly", "frozen", "full", "funny", "fuzzy", "gentle", "giant", "gifted", "glad", "global",
  "glossy", "golden", "good", "grand", "grateful", "great", "green", "grim", "gritty", "grumpy", "guilty",
  "handy", "happy", "hard", "harsh", "hasty", "healthy", "heavy", "hidden", "high", "hollow", "holy",
  "honest", "hot", "huge", "humble", "hungry", "icy", "ideal", "idle", "inner", "innocent", "jolly", "joyful",
  "juicy", "keen", "kind", "large", "last", "late", "lazy", "lean", "legal", "level", "light", "likely",
  "little", "lively", "local", "lonely", "long", "loose", "loud", "lovely", "loyal", "lucky", "lunar",
  "magic", "major", "mellow", "merry", "mild", "minor", "misty", "modern", "modest", "moist", "moral",
  "muddy", "narrow", "nasty", "native", "neat", "nervous", "new", "nice", "noble", "noisy", "normal", "novel",
  "odd", "old", "open", "orange", "ornate", "oval", "pale", "patient", "perfect", "plain", "pleasant",
  "polite", "poor", "popular", "precise", "pretty", "prime", "private", "proud", "public", "pure", "purple",
  "quick", "quiet", "rapid", "rare", "raw", "ready", "real", "regular", "remote", "rich", "rigid", "ripe",
  "robust", "rough", "round", "royal", "rude", "rural", "rusty", "sacred", "sad", "safe", "salty", "scarlet",
  "secret", "secure", "serene", "serious", "shallow", "sharp", "shiny", "short", "shy", "silent", "silky",
  "silly", "silver", "simple", "sincere", "sleepy", "slim", "slow", "small", "smart", "smooth", "snowy",
  "soft", "solar", "solid", "sour", "spare", "spicy", "splendid", "stable", "steady", "steep", "sticky",
  "stiff", "still", "stormy", "strange", "strict", "strong", "sturdy", "subtle", "sudden", "sunny", "super",
  "sweet", "swift", "tall", "tame", "tender", "thick", "thin", "thirsty", "tidy", "tight", "tiny", "tired",
  "total", "tough", "tropical", "true", "twin", "ugly", "unique", "upper", "urban", "usual", "vague", "valid",
  "vast", "velvet", "violet", "vital", "vivid", "warm", "wary", "weary", "wet", "wide", "wild", "windy",
  "wise", "witty", "wooden", "young", "zealous",
};

constexpr std::string_view kNouns[] = {
  "acorn", "actor", "adult", "advice", "agent", "airport", "alarm", "album", "alley", "anchor", "angle",
  "animal", "ankle", "answer", "apple", "apron", "arch", "arena", "arm", "army", "arrow", "artist", "atlas",
  "attic", "aunt", "author", "avenue", "baby", "badge", "bag", "bakery", "ball", "balloon", "banana", "band",
  "bank", "barn", "barrel", "basket", "bath", "battery", "beach", "beam", "bean", "bear", "beard", "bed",
  "bee", "bell", "belt", "bench", "berry", "bicycle", "bird", "blanket", "blossom", "boat", "body", "bone",
  "book", "boot", "bottle", "bowl", "box", "branch", "bread", "brick", "bridge", "broom", "brother", "brush",
  "bubble", "bucket", "budget", "bulb", "bus", "bush", "butter", "button", "cabin", "cable", "cactus", "cake",
  "camel", "camera", "camp", "canal", "candle", "canoe", "canyon", "cap", "captain", "car", "card", "carpet",
  "carrot", "cart", "castle", "cat", "cave", "ceiling", "cellar", "chain", "chair", "chalk", "cheese",
  "cherry", "chest", "chicken", "child", "chimney", "circle", "city", "class", "clock", "cloud", "coach",
  "coat", "coconut", "coffee", "coin", "collar", "comet", "compass", "cookie", "copper", "corn", "corner",
  "cottage", "cotton", "couch", "country", "cousin", "cow", "crab", "crayon", "crown", "cup", "curtain",
  "cushion", "daisy", "dance", "desert", "desk", "diamond", "dinner", "doctor", "dog", "doll", "dolphin",
  "door", "dragon", "drawer", "dream", "dress", "drum", "duck", "eagle", "ear", "earth", "egg", "elbow",
  "engine", "envelope", "eye", "fabric", "face", "factory", "falcon", "farm", "feather", "fence", "ferry",
  "field", "finger", "fire", "fish", "flag", "flame", "flask", "flower", "flute", "fog", "folder", "forest",
  "fork", "fountain", "fox", "frame", "friend", "frog", "fruit", "furnace", "garage", "garden", "garlic",
  "gate", "gem", "ghost", "gift", "giraffe", "glass", "glove", "goat", "gold", "grape", "grass", "guitar",
  "hammer", "hand", "harbor", "hat", "hawk", "heart", "helmet", "hill", "hive", "honey", "hook", "horse",
  "hospital", "hotel", "house", "iceberg", "ink", "island", "ivory", "jacket", "jar", "jelly", "jewel",
  "judge", "jungle", "kettle", "key", "king", "kitchen", "kite", "kitten", "knee", "knife", "knot", "ladder",
  "lake", "lamp", "lantern", "laptop", "lawn", "leaf", "lemon", "letter", "library", "lighthouse", "lily",
  "lion", "lizard", "lock", "magnet", "mango", "map", "marble", "market", "mask", "meadow", "melon", "mirror",
  "monkey", "moon", "mountain", "mouse", "mug", "museum", "nail", "needle", "nest", "net", "night",
  "notebook", "nurse", "oak", "ocean", "office", "olive", "onion", "orchard", "otter", "oven", "owl",
  "paddle", "page", "paint", "palace", "panda", "paper", "parrot", "path", "peach", "pear", "pebble",
  "pencil", "pepper", "piano", "picture", "pig", "pillow", "pilot", "pine", "pipe", "planet", "plate", "plum",
  "pocket", "poem", "pond", "pot", "potato", "pumpkin", "puzzle", "queen", "quilt", "rabbit", "radio", "rain",
  "raven", "ribbon", "river", "road", "robot", "rock", "roof", "room", "rope", "rose", "sail", "salad",
  "sand", "scarf", "school", "scissors", "sea", "seed", "shadow", "sheep", "shelf", "shell", "ship", "shirt",
  "shoe", "shovel", "singer", "sink", "sister", "skate", "sky", "sled", "snail", "snake", "soap", "sock",
  "sofa", "soup", "spider", "spoon", "spring", "square", "squirrel", "stage", "star", "station", "statue",
  "stone", "storm", "stove", "straw", "stream", "street", "sugar", "suitcase", "sun", "swan", "sweater",
  "table", "tail", "teacher", "temple", "tent", "thread", "throne", "thunder", "ticket", "tiger", "tomato",
  "tooth", "torch", "tower", "town", "toy", "tractor", "train", "tree", "truck", "trumpet", "tulip", "tunnel",
  "turtle", "umbrella", "valley", "vase", "violin", "wagon", "wall", "wallet", "wand", "watch", "water",
  "whale", "wheel", "whistle", "window", "wing", "winter", "wire", "wolf", "worm", "yacht", "yard", "zebra",
};

constexpr std::string_view kVerbs[] = {
  "accept", "add", "admire", "allow", "answer", "argue", "arrive", "ask", "bake", "balance", "bathe", "beg",
  "behave", "belong", "bless", "boil", "borrow", "bounce", "breathe", "build", "burn", "bury", "calculate",
  "call", "carry", "catch", "chase", "cheer", "chew", "clap", "climb", "collect", "comb", "cook", "copy",
  "count", "cover", "crawl", "cross", "cry", "dance", "decide", "deliver", "describe", "design", "dig",
  "divide", "drag", "draw", "dream", "dress", "drink", "drive", "drop", "earn", "eat", "enjoy", "enter",
  "escape", "explain", "explore", "fetch", "fill", "find", "fix", "float", "fold", "follow", "forgive",
  "gather", "glow", "grab", "greet", "grow", "guard", "guess", "hammer", "hang", "help", "hide", "hop", "hug",
  "hunt", "imagine", "invent", "invite", "jog", "join", "joke", "juggle", "jump", "kick", "kneel", "knit",
  "knock", "laugh", "learn", "lift", "listen", "live", "look", "love", "march", "measure", "melt", "mix",
  "move", "obey", "offer", "open", "order", "pack", "paint", "plant", "play", "polish", "pour", "pray",
  "print", "pull", "push", "race", "read", "relax", "remember", "repair", "rescue", "rest", "ride", "roll",
  "row", "run", "sail", "save", "scrub", "search", "sew", "shake", "share", "shine", "shout", "sing", "sit",
  "skip", "sleep", "slide", "smile", "sneeze", "solve", "sort", "spell", "spin", "splash", "stack", "stand",
  "steer", "stir", "stretch", "study", "swim", "swing", "talk", "teach", "throw", "tickle", "travel", "trust",
  "turn", "type", "visit", "walk", "wander", "wash", "watch", "wave", "weave", "whisper", "win", "wink",
  "wish", "work", "worry", "write", "yawn", "yell", "zoom",
};

}  // namespace

std::span<const std::string_view> adjectives() { return kAdjectives; }
std::span<const std::string_view> nouns() { return kNouns; }
std::span<const std::string_view> verbs() { return kVerbs; }

}  // namespace sparsa::eval
